"""Decisions: a state and named questions with a closed answer set, answered with a probability per option by
label scoring on a served model (POST /v1/systemone; the wire shape is engine/api/decisions.py)."""
