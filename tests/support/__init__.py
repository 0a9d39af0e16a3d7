"""Helpers shared by the tests: data generators, fuzzing, interrupting runs."""
