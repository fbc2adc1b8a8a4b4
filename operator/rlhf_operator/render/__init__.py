"""Pure rendering: a job's spec in, its child objects out (children.py; the pods' shared
parts: pod.py; the NetworkPolicy: network.py). No API calls."""
