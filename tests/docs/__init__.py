"""Pure-CPU tests of the documentation: the README's and docs/*.md's runnable python blocks."""
