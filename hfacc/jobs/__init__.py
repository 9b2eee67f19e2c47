"""The jobs behind the recipes and ``hfacc sft`` / ``dpo`` / ``grpo``: settings, the embedded defaults, the run and
its summary, the console they print to and the reports they write.

May use every folder below it.
"""
