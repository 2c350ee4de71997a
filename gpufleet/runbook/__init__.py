"""YAML runbooks: the model (model), reading and validating (load), variables (template), step
kinds and their fields (kinds), the values only runbooks have (values), running (run), one
executor per step kind (steps) and what steps read from a snapshot (checks)."""
