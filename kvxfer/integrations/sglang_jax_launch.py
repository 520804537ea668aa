"""sglang-jax's server, with kvxfer's host pool installed in every engine process.

Run it as the engine's own launcher, with the same arguments and HiCache on::

    python -m kvxfer.integrations.sglang_jax_launch --model-path ... --hicache-storage none

sglang-jax starts its scheduler in processes of its own (``multiprocessing`` with
``spawn``), and ``spawn`` runs the launching module again in each of them under the
name ``__mp_main__``: ``install()`` below runs there too, before the scheduler builds
its HiCache. Importing this module does nothing (``install()`` only runs as a program
or in the processes it spawns). Without sglang-jax, or with one whose names differ from
those checked against, it says so on one line and exits 2.
"""

import sys

from kvxfer.integrations.sglang_jax import install

__all__: list[str] = []  # a program: nothing to import

if __name__ == "__mp_main__":
    install()

if __name__ == "__main__":
    try:
        install()
        from sgl_jax.launch_server import main
    except ImportError as e:
        print(f"kvxfer.integrations.sglang_jax_launch: error: {str(e).splitlines()[0]}",
              file=sys.stderr)
        sys.exit(2)
    main()
