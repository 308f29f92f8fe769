"""fa4 inside other libraries (each an optional dependency, imported only by its module)."""
