"""Builders of the engines the tests and benchmarks run against; each is also a program the test command runs."""
