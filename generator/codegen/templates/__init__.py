"""Source templates: derived math (as data) in, TileLang program source text out."""
