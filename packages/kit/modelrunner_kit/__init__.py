"""modelrunner's plugin kit (the ``modelrunner-kit`` distribution).

- :mod:`modelrunner_kit.conformance`: the conformance suite of every plugin kind and ``modelrunner check``;
- :mod:`modelrunner_kit.scaffold`: ``modelrunner new-plugin``, a working skeleton of each kind;
- :mod:`modelrunner_kit.testing`: a model loaded as the runner loads it, driven step by step;
- :mod:`modelrunner_kit.allocator_contract`: the KV-cache allocator contract as a pytest class.

The kernel never imports the kit; its CLI finds ``check`` and ``new-plugin`` through the
``modelrunner.subcommands`` entry points this distribution declares. The kit imports the kernel through
``modelrunner.api`` and ``modelrunner``; where it needs a kernel internal (to build or load exactly what
the runner would), the import says so with a ``# kernel internal`` comment. Importing this package is
cheap: the submodules load torch and the kernel when used.
"""
