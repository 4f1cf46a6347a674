"""Keeping KV across requests: warm sessions a new prompt continues from (pool.py), the same on disk
(disk.py: --session-dir, chat --session), and idle-time warming of the next turn's prompt (warming.py)."""
