"""Fast paths of the drafter ports: subclasses of each plain Model (compiled pieces, the bucketed
block), held to it by tests/test_speed.py and tests/test_bucketed.py."""
