"""Prompts and tasks: the prompt stream of a job (`prompts`), and the toy tasks with
their rule-based rewards (`tasks`)."""
