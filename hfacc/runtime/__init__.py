"""What a run is made of besides its model and data: settings from dataclasses, YAML and flags (``config``), the
ranks and what data parallelism changes (``distributed``), peak memory (``memory``).

May use: ``ops``.
"""
