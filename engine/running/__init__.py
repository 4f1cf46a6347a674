"""Requests running on a loaded model: many at once (scheduler.py: the queue and its thread; stepper.py: the
admitted sequences, a prompt chunk and one batched decode step per turn), or goinfer chat's one conversation whose
cache outlives its turns (conversation.py)."""
