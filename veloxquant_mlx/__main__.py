"""``python -m veloxquant_mlx ...`` = ``veloxquant ...``; also a file path ``mlx.launch`` can run on every rank:

    mlx.launch -n 3 --backend ring --python "$(which python3)" "$(python3 -m veloxquant_mlx --launch-path)" generate ...
"""
import os
import sys

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path.pop(0)  # run as a file: this package's modules must not shadow top-level ones
    if sys.argv[1:] == ["--launch-path"]:
        print(os.path.abspath(__file__))
        sys.exit(0)
    from veloxquant_mlx.apps.launcher import run

    run()
