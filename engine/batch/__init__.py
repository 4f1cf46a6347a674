"""JSONL batch runs in the OpenAI Batch line format, resumable; shared by `goinfer batch` and /v1/batches.

    run_batch(input, output, load_model, defaults=..., system=..., should_stop=..., on_plan/on_line/on_token)
    read_input(path) -> [BatchLine]     errors_path(output) -> Path
    check_input(path) -> [(lineno, problem)]  every line's problem a run would meet without a model
"""

from engine.batch.io import BatchLine, check_input, errors_path, read_input
from engine.batch.runner import BatchPlan, BatchSummary, LineResult, run_batch

__all__ = ["BatchLine", "BatchPlan", "BatchSummary", "LineResult", "check_input", "errors_path", "read_input",
           "run_batch"]
