"""The GPU check (`python -m gpu_check`, `make gpu-check`): the acceptance test on a real GPU, each part in a process
of its own (`__main__.py` runs them, `parts.py` lists them)."""
