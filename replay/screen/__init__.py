"""Screening a run from its logs alone: statistics, ``replay scan`` and batch forensics (inspect).

Imports the ground room (``replay.run``) and, where a check replays steps, ``replay.verify``.
"""
