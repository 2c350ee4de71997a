"""bench/ holds benchmarks, not tests: pytest collects nothing here, even if pointed at it."""
collect_ignore_glob = ["*.py", "*.sh"]
