"""The public API on CPU caches: argument checking of decode, verify / commit, snapshot_verify and
packed (varlen) verify, and the speculative protocol."""
