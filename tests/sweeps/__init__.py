"""The sweeps/ scripts and perf.py on the CPU (tiny shapes), and where sweeps write their results."""
