"""What the run's header says when pytest-timeout is missing: shared by ``conftest.py`` and
``test_pytest_setup.py`` (a test module cannot import ``conftest``: several folders have one)."""

#: What the run's header says when pytest-timeout (pyproject's ``timeout``) is not installed.
NO_TIMEOUT = ("timeout: none, pytest-timeout is not installed (pyproject's timeout = 600 needs it: "
              "pip install pytest-timeout, or pip install -e .[dev])")
