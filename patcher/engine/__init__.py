"""engine: run a recipe's LibCST codemods over a tree (pipeline, classify), read and write it safely (files, write, journal); recipes are data (recipe).
May import: patcher.results, patcher.errors, the stdlib and libcst; never verify, ci, report, api or cli.
"""
