"""The benchmark suite: the Trio orchestrator against its asyncio twin.

``omni-trio bench`` runs every scenario once per implementation, each in its own
process (``python -m omni_trio.bench --impl NAME``), and prints the comparison.
"""
