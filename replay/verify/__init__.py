"""Range replay (its plan: ``plan``; the engine: ``engine``), comparison with the log, verdicts, and the
canary on chosen devices.

Reads what a training run wrote (``replay.run``) and rebuilds its steps through the run's
``RunSetup``; imports only the ground room.
"""
