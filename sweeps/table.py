"""Render a bench_decode.py CSV as the markdown tables shown in the README, one per layer type.

    python sweeps/table.py sweeps/results/decode_h200.csv

CSVs written before GDN was benchmarked have no `layer` column: their rows are Mamba-2.
"""

import argparse

import pandas as pd

LAYER_TITLES = {"mamba2": "Mamba-2", "gdn": "Gated DeltaNet"}


def main(path: str) -> None:
    df = pd.read_csv(path)
    if "layer" not in df.columns:
        df.insert(1, "layer", "mamba2")
    rates = ", ".join(f"{r:.2f}" for r in sorted(df.copy_tbps.round(2).unique()))
    print(f"copy bandwidth measured in the same run: {rates} TB/s")
    for layer, rows in df.groupby("layer", sort=False):
        print(f"\n{LAYER_TITLES.get(layer, layer)}\n")
        print("| model | batch | conventional us (% copy) | ReplaySSM window mean us (% copy) | staggered rows | "
              "non-flush mean us (% copy) | flush us (% copy) | speedup |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows.itertuples():
            print(f"| {r.model} | {r.batch} | {r.conv_us:.1f} ({r.conventional_frac_copy:.0%}) | "
                  f"{r.replay_mean_us:.1f} ({r.window_mean_frac_copy:.0%}) | "
                  f"{r.replay_staggered_us:.1f} ({r.staggered_vs_aligned:.3f}x aligned) | "
                  f"{r.nonflush_mean_us:.1f} ({r.nonflush_mean_frac_copy:.0%}) | "
                  f"{r.flush_us:.1f} ({r.flush_frac_copy:.0%}) | {r.speedup_mean_vs_conv:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Render a bench_decode.py CSV as markdown tables.")
    parser.add_argument("csv", nargs="?", default="sweeps/results/decode_h200.csv")
    main(parser.parse_args().csv)
