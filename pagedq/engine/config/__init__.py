"""The engine's configuration: the model and engine configs (engine.py), speculative decoding (speculative.py) and
the architectures served (architectures.py). Empty itself, so that the flag parsers import a part without torch."""
