"""The RLHFJob API: its types (job.py; its status: status.py; pod-level types:
podspec.py), the CRD generated from them (crd.py) and parsing with field-pathed errors
(validation.py). No API calls."""
