"""`make bench`: every benchmark, one after another."""

from benchmarks import tape_append

tape_append.main()
