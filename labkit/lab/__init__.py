"""The lab: experiments run from a config, live plots, slider panels and the headless demo."""
