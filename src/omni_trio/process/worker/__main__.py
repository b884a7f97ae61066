"""``python -m omni_trio.process.worker --control-fd N``: a stage worker process."""

if __name__ == "__main__":
    from ._main import main

    main()
