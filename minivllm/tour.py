"""The old name of ``minivllm/learn/tour.py`` (the guided walk through the article's steps):
``python -m minivllm.tour spec|pd [--pdb] [--no-wait] ...`` runs its ``main``; its names are
re-exported here."""
from minivllm.learn.tour import (PD_CONNECTORS, PD_PROMPTS, REFERENCE_ENV, SPEC_METHODS,  # noqa: F401
                                 SPEC_PROMPTS, TOURS, Stop, Tour, describe_frame, main, pd_stops,
                                 reference_paths, run, short)

if __name__ == "__main__":
    import sys
    sys.exit(main())
