"""The operator as a program: the kopf wiring (handlers.py), its metrics and health
endpoints (metrics.py) and the rlhfjob CLI (cli.py)."""
