"""pytrain: fast, safe LLM pretraining."""
