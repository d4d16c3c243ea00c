"""Helpers the tests, benchmarks and GPU scripts share; not part of the
installed package. Import from the checkout root (pytest's `pythonpath`; the
benchmark scripts put the root on `sys.path`)."""
