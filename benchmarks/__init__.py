"""tapegrad's benchmarks; `make bench` runs `python -m benchmarks`."""
