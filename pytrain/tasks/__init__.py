"""Downstream tasks: multiple-choice, schema and language-modelling items scored by the
log-likelihood a model gives each continuation, as lm-evaluation-harness scores them
(docs/DOWNSTREAM.md).

    items     the task file format (JSONL or Parquet): TaskSpec, Item, read_task, TaskError
    requests  an item as (context, continuation) pairs, few-shot examples drawn with a seed
    scoring   token split as lm-evaluation-harness does it, items packed into rows under the
              document mask, the log-likelihood of each continuation
    metrics   acc, acc_norm, acc_bytes per task and the CORE-style mean centred on chance
    convert   public datasets as users keep them (HellaSwag, ARC, PIQA, ...) into the format

Only scoring imports torch."""
