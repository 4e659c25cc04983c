"""The code that runs in a worker process, inside the sandbox beside the arm's engine:
`python -m scoreboard.worker REQUEST.json RESULT.json` (serve), the rank group for multi-process
candidates (distributed), the clock handshake's wire both ends share (handshake), and the harness's
null engine (nullengine). This is the only harness package that imports torch (distributed, lazily).

Anything here can be replaced by the candidate's code at run time, so nothing here takes time, seals or
decides: the parent (scoreboard.round) does. See docs/layout.md.
"""
