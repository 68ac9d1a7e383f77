"""``python -m agent.cli``: the same as the ``prewarm`` script."""

from agent.cli import main

if __name__ == "__main__":
    main()
