"""Mutation testing of redfuser-ops: see tests/mutation/run.py."""
