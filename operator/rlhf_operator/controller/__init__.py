"""The level-based controller: one reconcile per job (reconcile.py), its one status
writer (status.py), restart decisions (restarts.py), the work queue (workqueue.py) and
the API client (kube.py)."""
