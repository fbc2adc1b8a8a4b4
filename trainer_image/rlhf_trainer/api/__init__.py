"""The contract between the operator and the trainer: the spec models (`config`, with
its sections in `sections`), the cross-field rules with their CEL twins (`rules`), the
placement plan (`plan`) and the names both sides use (`names`). Imports neither torch
nor Ray: the operator image has neither."""
