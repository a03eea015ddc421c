"""Named, reversible patches on Megatron-Core / torch.

A :class:`Patch` swaps attributes (``owner.attr = replacement``) and keeps the originals; ``install``
and ``uninstall`` are idempotent. :class:`PatchRegistry` holds the installed ones by name so the
whole set can be reverted at once (``patches.uninstall_all()``).
"""

import logging

logger = logging.getLogger(__name__)


class Patch:
    """A named set of attribute replacements; ``on_install``/``on_uninstall`` hooks do the rest."""

    def __init__(
        self, name, replacements=(), on_install=None, on_uninstall=None, after_uninstall=None
    ):
        self.name = name
        self.replacements = list(replacements)  # (owner, attr, new_value)
        self.on_install = on_install  # after the replacements are in place
        self.on_uninstall = on_uninstall  # while they still are
        self.after_uninstall = after_uninstall  # once the originals are back
        self._originals = None

    @property
    def installed(self):
        return self._originals is not None

    def install(self):
        """Apply every replacement, then ``on_install``; all or nothing: if one fails, those
        already applied are reverted and the error propagates."""
        if self.installed:
            return False
        applied = []
        try:
            for owner, attr, new in self.replacements:
                orig = (
                    owner.__dict__.get(attr, _MISSING)
                    if isinstance(owner, type)
                    else getattr(owner, attr, _MISSING)
                )
                setattr(owner, attr, new)
                applied.append((owner, attr, orig))
            self._originals = applied
            if self.on_install:
                self.on_install()
        except BaseException:
            _restore(applied)
            self._originals = None
            raise
        logger.debug("installed patch %s", self.name)
        return True

    def uninstall(self):
        if not self.installed:
            return False
        if self.on_uninstall:
            self.on_uninstall()
        _restore(self._originals)
        self._originals = None
        if self.after_uninstall:
            self.after_uninstall()
        return True


def _restore(originals):
    for owner, attr, orig in reversed(originals):
        if orig is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, orig)


class _Missing:
    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()


class PatchRegistry:
    """Installed patches by name, uninstalled in reverse order of installation."""

    def __init__(self):
        self._patches = {}

    def install(self, patch):
        if patch.name in self._patches:
            return self._patches[patch.name]
        patch.install()
        self._patches[patch.name] = patch
        return patch

    def uninstall(self, name):
        patch = self._patches.pop(name, None)
        if patch is not None:
            patch.uninstall()
        return patch

    def uninstall_all(self):
        names = list(self._patches)
        for name in reversed(names):
            self.uninstall(name)
        return names

    def installed(self):
        return list(self._patches)

    def get(self, name):
        return self._patches.get(name)


#: The process's record of what is patched. Patches replace module attributes, which are process
#: state whatever we do; this one registry is where that state is written down, so that everything
#: can be reverted at once (the end of a job, a test).
REGISTRY = PatchRegistry()
