"""``python -m minivllm.disagg.fleet``: the fleet command (driver.py)."""
from minivllm.disagg.fleet.driver import main

if __name__ == "__main__":
    main()
