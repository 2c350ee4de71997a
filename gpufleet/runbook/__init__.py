"""YAML runbooks: model and load (load), step kinds (kinds), field values (values), running
(run), one executor per step kind (steps) and what steps read from a snapshot (checks)."""
