"""Entry points: what composes the core and both shells (the ``sluice`` CLI, the live demo and
its agent client). Dependencies point one way: ``scheduler`` ← ``controller`` / ``sim`` ←
``entry``; the two shells never import each other.
"""
