"""Trainer `tide` (verl's V1 trainer registry): `tide.TideTrainer` holds verl's hooks; the modules beside it
hold what each hook delegates to. Importing this package registers nothing: the `verl.plugins` entry point
(`verl_tide.register`) registers the trainer when verl imports its registry."""
