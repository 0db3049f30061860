"""`python -m pytrain.train` (cli) and what a training run is made of: the loop (trainer),
the step guard, compile policy, precision, distributed set-up, evaluation, checkpoints,
metrics, profiling and the final report. Importing this package imports no torch: the
entry point sets environment guards (env_guards) first."""
