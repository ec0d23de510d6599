"""The plugin author's test kit: load an adapter's model as the runner would and drive it step by step.

Importing this package needs only torch; the conformance suites that need pytest live in its submodules.
"""

from .models import AdapterUnderTest, PagedDriver, load_adapter

__all__ = ["AdapterUnderTest", "PagedDriver", "load_adapter"]
