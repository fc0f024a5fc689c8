"""experiments/functional_state.ipynb runs from top to bottom in a fresh kernel of this interpreter.

Needs the ``notebook`` extra (nbclient, ipykernel, matplotlib); skipped where nbclient is not installed. The
notebook is executed in memory: the committed file, outputs included, is never rewritten.
"""

from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")

import nbformat  # noqa: E402  (installed with nbclient)
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "experiments" / "functional_state.ipynb"
CELL_TIMEOUT_S = 600  # compiling generate's programs takes most of a minute on a busy 2-core CPU


@pytest.mark.slow
def test_functional_state_notebook_runs_without_error():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # No kernel directories: only the native python3 kernel is found, which is this interpreter (sys.executable),
    # whatever kernelspecs the user has installed elsewhere.
    kernel = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    client = nbclient.NotebookClient(notebook, km=kernel, timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(REPO)}})
    client.execute()  # raises CellExecutionError, naming the cell and its traceback, at the first error
