"""Benchmarks shipped with the CLI (`onecopy bench ...`)."""
