import pathlib

print(pathlib.Path(__file__).with_name("greeting.txt").read_text().strip())
