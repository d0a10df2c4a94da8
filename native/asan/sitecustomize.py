"""`make test-native-asan` puts this folder on PYTHONPATH: attnserve.server._native is then the
sanitizer build beside this file, in the test process and in every server it starts, while
server/_native*.so (`make native`) stays as it is."""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

_NAME = "attnserve.server._native"
_BUILT = sorted(Path(__file__).parent.glob("_native*.so"))


class _SanitizerBuild(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _NAME or not _BUILT:
            return None
        loader = importlib.machinery.ExtensionFileLoader(_NAME, str(_BUILT[0]))
        return importlib.util.spec_from_file_location(_NAME, _BUILT[0], loader=loader)


sys.meta_path.insert(0, _SanitizerBuild())
