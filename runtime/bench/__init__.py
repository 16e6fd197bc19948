"""Benchmarks behind ``kvdrive bench``: JSON results, a table and a plot."""
