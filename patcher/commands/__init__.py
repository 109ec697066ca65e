"""The CLI's building blocks: what every command shares (``base``) and the commands of their own modules.
Imported by ``patcher.cli`` only."""
