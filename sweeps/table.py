"""Render a bench_decode.py CSV as the markdown table shown in the README.

    python sweeps/table.py sweeps/results/decode_h200.csv
"""

import sys

import pandas as pd


def main(path: str) -> None:
    df = pd.read_csv(path)
    print(f"copy bandwidth measured in the same run: {df.copy_tbps.iloc[0]:.2f} TB/s\n")
    print("| model | batch | conventional us (% copy) | ReplaySSM window mean us (% copy) | staggered rows | "
          "non-flush mean us (% copy) | flush us (% copy) | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in df.itertuples():
        print(f"| {r.model} | {r.batch} | {r.conv_us:.1f} ({r.conventional_frac_copy:.0%}) | "
              f"{r.replay_mean_us:.1f} ({r.window_mean_frac_copy:.0%}) | "
              f"{r.replay_staggered_us:.1f} ({r.staggered_vs_aligned:.3f}x aligned) | "
              f"{r.nonflush_mean_us:.1f} ({r.nonflush_mean_frac_copy:.0%}) | "
              f"{r.flush_us:.1f} ({r.flush_frac_copy:.0%}) | {r.speedup_mean_vs_conv:.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sweeps/results/decode_h200.csv")
